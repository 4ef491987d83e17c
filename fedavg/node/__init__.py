"""A node: local training (plain PyTorch), the recipe, the wire contract and the ClientApps."""

"""Models: the registry of builders, outside sources (torchvision, Hugging Face, your code)."""

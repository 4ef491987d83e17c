"""The typed settings of a run (each option declared once), their checks and value conversion."""

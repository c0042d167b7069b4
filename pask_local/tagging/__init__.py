"""Structural tagging: prompt spans -> token classes (``prompt``), generated tokens (``generated``)."""

"""Training: SFT data loading and the training recipes."""

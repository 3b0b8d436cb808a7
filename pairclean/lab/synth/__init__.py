"""Lab worlds: synthetic data with known ground truth, for checking that scores separate
clean from mismatched pairs when no pre-trained CLIP can be downloaded."""

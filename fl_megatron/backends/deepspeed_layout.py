"""Where DeepSpeed's files lie in a saved group's directory: the backend saves there, and the
pickle check and the offline reader look there."""

CHECKPOINT_TAG = "zero3"  # DeepSpeed's sub-directory inside a group's checkpoint directory

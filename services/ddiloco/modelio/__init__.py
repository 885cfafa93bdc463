"""The trained model in the user's hands: read the global model of a run (read-only, also
while it runs), export it as a plain state dict, inspect a checkpoint, sample text."""

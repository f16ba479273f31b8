"""Loading models: folders, hub ids and built-ins; checkpoints; model facts; memory."""

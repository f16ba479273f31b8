"""JSONL batches, results files, OpenAI batch files, and Ray."""

"""Prompts: the built-in digit tasks (toy), text prompt sources (jsonl, parquet, reasoning-gym) read lazily, a seeded
resumable stream over them, tokenizer / chat-template encoding, TextTask, and prompt retirement."""

"""Prompts and verifiable rewards: the built-in digit tasks, jsonl prompt sets, and a math answer verifier."""

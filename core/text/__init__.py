"""Text in and out: the tokenizers and chat templates."""

"""Integrations: Hugging Face Trainer callback, accelerate training loop."""

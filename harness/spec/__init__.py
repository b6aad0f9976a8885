"""Specs, resolved once: models (catalog, tiny zoo, Hub or local checkpoints), adapters and their file formats, prompt
sets, router facts. The shared vocabulary engines may import."""

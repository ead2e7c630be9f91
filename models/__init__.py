"""A GPT-3-style model (models.gpt) and its training on synthetic tokens, on one GPU or many
under torchrun with FSDP2 (models.train): the model the training suite (harness/train.py)
measures every attention provider in."""

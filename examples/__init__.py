"""Example flat-batch models: forward(input_ids[T], positions[T], logits_indices[R]) -> logits[R, vocab]."""

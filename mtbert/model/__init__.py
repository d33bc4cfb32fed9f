"""The model: one shared encoder with a head per task, the siamese QQP head's cosine start,
dropout at a rate held in a device tensor, and the fused encoder's attention on the CPU."""

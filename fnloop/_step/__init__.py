"""Forward, backward and update as one traced, compiled step; evaluation and export on its tensors."""

"""Per-layer timing, memory and communication of our layers against torch-native TP + SP."""

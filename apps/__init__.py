"""Applications above the library layers: training and parity (their data, command lines)."""

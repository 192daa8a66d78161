"""The escha kernel backends, one folder each (docs/kernels.md, "Adding a kernel")."""

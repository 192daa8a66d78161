"""The pack check: plain rule functions over an opened pack, one module per concern (:mod:`.layers`: the decoder
layers' layout; :mod:`.architectures`: the layers of the model classes the project states)."""

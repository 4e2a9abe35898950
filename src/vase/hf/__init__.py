"""The transformers integration below the caches: the attention function, masks, hybrid (linear-attention)
layers, model support, the speculative-decoding bookkeeping and the version differences."""

"""The decode loop, beam search, speculative decoding and its drafters."""

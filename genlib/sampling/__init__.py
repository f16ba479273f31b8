"""A step's logits to a token: processors, draws, stops, constraints, grammars."""

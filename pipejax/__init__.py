"""pipejax: elastic pipelining of transformers in JAX (PipeTransformer)."""

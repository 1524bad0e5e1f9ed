"""A throwaway mm task plugin: a language model trained against a critic, with two optimizers."""

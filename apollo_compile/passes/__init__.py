"""The passes, one per module; ``apollo_compile.pipeline`` lists them in order."""

"""The validation jobs, one module each (the order and names: :mod:`moepipe.validate.registry`)."""

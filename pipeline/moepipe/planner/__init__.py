"""Planning before building: which parallel mapping fits a cluster (``moepipe plan``) and where
experts go from measured load (``moepipe balance``)."""

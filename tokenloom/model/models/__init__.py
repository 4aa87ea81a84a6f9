"""Model families beyond Llama's layer as it is: one file per family, each a small decoder-layer class
on tokenloom/model/layers.py's blocks, named in registry.py (architecture -> module and class) and
imported only when a model of that family loads."""

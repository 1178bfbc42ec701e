"""A checkpoint reader over the shapes of a model built on the meta device (transformers'
in-memory, fused-expert layout): conversion plans of real configs without any weights."""


class MetaReader:
    def __init__(self, model):
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}

    def has(self, name):
        return name in self.shapes

    def shape(self, name):
        return self.shapes[name]

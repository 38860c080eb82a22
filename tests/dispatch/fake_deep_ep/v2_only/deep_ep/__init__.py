"""TEST DOUBLE, not DeepEP: a `deep_ep` offering only the V2 `ElasticBuffer` (by name), for the gate's tests
that the deepep adapter takes it (and that api='v1' is refused).  Nothing here can run."""


class ElasticBuffer:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("test double of deep_ep: not DeepEP")

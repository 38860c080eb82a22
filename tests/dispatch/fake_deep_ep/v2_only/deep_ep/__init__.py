"""TEST DOUBLE, not DeepEP: a `deep_ep` offering only the V2 `ElasticBuffer` (by name), for the gate's test
that our V1 adapter refuses it with the reason.  Nothing here can run."""


class ElasticBuffer:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("test double of deep_ep: not DeepEP")

"""TEST DOUBLE, not DeepEP: a `deep_ep` offering Buffer, ElasticBuffer and HybridEPBuffer by name only
(see ../../README.md).  Constructing any of them fails: the gate must never get that far."""


class _Refuse:
    def __init__(self, *args, **kwargs):
        raise AssertionError("test double: the fake deep_ep classes are never constructed")


class Buffer(_Refuse):
    pass


class ElasticBuffer(_Refuse):
    pass


class HybridEPBuffer(_Refuse):
    pass

"""TEST DOUBLE, not DeepEP: a `deep_ep` offering only the V1 `Buffer` (by name), as a build from before V2
(see ../../README.md).  Constructing it fails: the gate must never get that far."""


class Buffer:
    def __init__(self, *args, **kwargs):
        raise AssertionError("test double: the fake deep_ep classes are never constructed")

"""Layer ids for the rank view: from layer names, or from the identity's order."""

from __future__ import annotations

from kvstore.inspect.rank import format_slots, group_geometry
from tests.helpers import make_mla_identity, make_two_group_identity


def test_layer_ids_from_names() -> None:
    geometry, source = group_geometry(make_mla_identity(), 0)
    assert source == "names"
    assert geometry.layer_ids == (0, 1, 2, 3) and geometry.num_hidden_layers == 4
    assert (geometry.kind, geometry.latent_dim, geometry.elem_size) == ("mla", 576, 2)


def test_layer_ids_fall_back_to_identity_order() -> None:
    identity = make_two_group_identity()  # group 1 has a layer named "extra": no number
    g0, source = group_geometry(identity, 0)
    g1, _ = group_geometry(identity, 1)
    assert source == "order"
    assert g0.layer_ids == (0, 1) and g1.layer_ids == (2, 3)
    assert g0.num_hidden_layers == g1.num_hidden_layers == 4


def test_format_slots() -> None:
    assert format_slots(list(range(4, 12))) == "4..11"
    assert format_slots([1, 3, 5, 7]) == "1,3,..,7 (every 2)"
    assert format_slots([4, 5, 6, 7, 12, 13]) == "4-7,12-13"

"""The drafter service's protobuf edge: ``Draft`` <-> ``specmesh.v1.DraftMessage``."""

from __future__ import annotations

from services.common.types import Draft
from specmesh.v1 import drafter_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Drafter"].full_name


def draft_to_pb(d: Draft) -> pb.DraftMessage:
    return pb.DraftMessage(
        token_ids=d.token_ids,
        parents=d.parents,
        token_probs=d.token_probs,
        score=d.score,
        match_len=d.match_len,
        source=d.source,
        tree=d.features.get("tree", ""),
    )


def draft_from_pb(m: pb.DraftMessage) -> Draft:
    return Draft(
        token_ids=list(m.token_ids),
        parents=list(m.parents),
        score=m.score,
        source=m.source,
        match_len=m.match_len,
        token_probs=list(m.token_probs),
        features={"tree": m.tree},
    )

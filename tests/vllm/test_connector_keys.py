"""What the connector keys a request by (no engine needed: vLLM's request objects stood in
for by their attributes).  Tokens alone do not say what a multimodal prompt's KV is: a
placeholder token stands for an image, so two prompts with the same tokens and other images
must never share KV; a prompt given as embeddings has no tokens to key by at all."""

from __future__ import annotations

from types import SimpleNamespace

from io_actors.vllm.connector import _cacheable, _salt


def _request(salt: str | None = None, images: tuple[str, ...] = (),
             embeds: object = None) -> SimpleNamespace:
    features = [SimpleNamespace(modality="image", identifier=image,
                                mm_position=SimpleNamespace(offset=4 + 10 * i, length=8))
                for i, image in enumerate(images)]
    return SimpleNamespace(cache_salt=salt, mm_features=features, prompt_embeds=embeds)


def test_other_images_behind_the_same_tokens_are_other_keys() -> None:
    cat, dog = _request(images=("cat-hash",)), _request(images=("dog-hash",))
    assert _salt(cat) != _salt(dog)
    assert _salt(cat) == _salt(_request(images=("cat-hash",)))
    assert _salt(cat) != _salt(_request())          # text only
    assert _salt(_request("t1", ("cat-hash",))) != _salt(cat)


def test_no_tenant_salt_spells_another_requests_inputs() -> None:
    forged = _request(salt=_salt(_request(images=("cat-hash",))))
    assert _salt(forged) != _salt(_request(images=("cat-hash",)))
    assert _salt(_request("a")) != _salt(_request(None)) != _salt(_request(""))


def test_prompt_embeddings_are_neither_matched_nor_saved() -> None:
    assert _cacheable(_request())
    assert not _cacheable(_request(embeds=object()))

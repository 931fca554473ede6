"""A Responses input is text up to the text limit, or a list of at most MAX_INPUT_ITEMS
items: the item limit is not a limit on the text."""

import pytest
from pydantic import ValidationError

from gateway.server.openai.schemas import MAX_INPUT_ITEMS, ResponseCompactRequest, ResponseRequest


@pytest.mark.parametrize("body", [ResponseRequest, ResponseCompactRequest])
def test_a_text_input_longer_than_the_item_limit_is_taken(body) -> None:
    assert len(body.model_validate({"model": "llm", "input": "x" * (MAX_INPUT_ITEMS + 1000)}).input) > MAX_INPUT_ITEMS


def test_an_input_of_more_items_than_the_limit_is_refused() -> None:
    with pytest.raises(ValidationError):
        ResponseRequest.model_validate(
            {"model": "llm", "input": [{"role": "user", "content": "x"}] * (MAX_INPUT_ITEMS + 1)}
        )

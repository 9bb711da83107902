"""Library warnings that repeat every step are shown once (``omnirl_core.host.quiet``)."""

import io
import logging

from omnirl_core.host.quiet import _FILTER, OncePerKind, show_repeats_once


def test_a_message_kind_passes_once_and_errors_always():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(OncePerKind())
    logger = logging.getLogger("transformers.omnirl-test")
    logger.addHandler(handler)
    logger.propagate = False
    for words in ("a red apple", "two cats on a mat"):
        logger.warning("The following part of your input was truncated because CLIP can only handle sequences "
                       f"up to 77 tokens: ['{words}']")
    logger.warning("Token indices sequence length is longer than the specified maximum (91 > 77)")
    logger.warning("Token indices sequence length is longer than the specified maximum (120 > 77)")
    logger.warning("something else")
    logger.error("a failure")
    logger.error("a failure")
    own = logging.getLogger("omnirl.test-quiet")  # omnirl's own warnings are never dropped
    own.addHandler(handler)
    own.propagate = False
    own.warning("tracker 'x' failed at step 1")
    own.warning("tracker 'x' failed at step 2")
    lines = stream.getvalue().splitlines()
    assert lines == [
        ("The following part of your input was truncated because CLIP can only handle sequences up to 77 tokens: "
         "['a red apple']"),
        "Token indices sequence length is longer than the specified maximum (91 > 77)",
        "something else", "a failure", "a failure", "tracker 'x' failed at step 1", "tracker 'x' failed at step 2"]


def test_installed_on_the_handlers_that_print_the_libraries_messages():
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.get_logger("diffusers.pipelines")  # sets up the library's handler
    show_repeats_once()
    show_repeats_once()  # idempotent
    handlers = logging.getLogger("diffusers").handlers
    assert handlers and all(h.filters.count(_FILTER) == 1 for h in handlers)

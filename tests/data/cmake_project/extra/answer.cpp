// Found by file(GLOB) without CONFIGURE_DEPENDS.
extern "C" int demo_extra_answer(void) { return 42; }

// gcc_macro_use: a GCC plugin that writes down which command-line macros a run depended on.
//
// Built by //toolchains:gcc-macro-use against the pinned GCC's plugin headers and loaded into
// nvcc's preprocessing and host-compile steps (build_graph/macro_use.py says how the rebuilder
// reads the record). It changes nothing the compiler writes; it only listens to libcpp:
//
//   used NAME   a macro the command line defined or undefined (-D/-U) that the run expanded,
//               tested (#ifdef, #ifndef, defined), or changed again (a #define or #undef in a
//               file, a second -D/-U, or a -D of a predefined macro);
//   seen NAME   an identifier starting with the `watch` prefix that the run lexed or pasted
//               (still in the identifier table, looked at before each collection and at the end).
//
// A run that did not use NAME would have run the same with another value of it, or without
// it: every consultation of a macro's definition goes through these callbacks (they are what
// -dU prints). An identifier never seen could not have been consulted had it been defined.
// If another part of GCC took over a callback (-dD, -dU, -g3), macros are dumped (-dM), the input
// was already preprocessed, or a definition came from an origin it does not know, the record says
// `incomplete` and the rebuilder relies on the exact command line only.
//
// Arguments: -fplugin-arg-gcc_macro_use-out=FILE (required), -fplugin-arg-gcc_macro_use-watch=PREFIX.

#include "gcc-plugin.h"
#include "plugin-version.h"
#include "cpplib.h"
#include "input.h"
#include "tree.h"
#include "c-family/c-common.h"  // flag_dump_macros
#include "c-family/c-pragma.h"  // parse_in, the C family front ends' preprocessor

#include <cstdio>
#include <cstring>
#include <set>
#include <string>

int plugin_is_GPL_compatible;

namespace {

const char *out_path = nullptr;
std::string watch;
bool past_built_ins = false, unknown_origin = false;
std::set<std::string> predefined, command_line, used, seen;

std::string name_of(cpp_hashnode *node) {
  return std::string(reinterpret_cast<const char *>(NODE_NAME(node)), NODE_LEN(node));
}

void changed(location_t loc, cpp_hashnode *node) {
  // libcpp files the built-in definitions under "<built-in>" and every -D/-U under
  // "<command-line>" (untranslated in the sandbox's C locale); anything else in angle brackets
  // is an origin this plugin does not know, and the record says so.
  std::string name = name_of(node);
  const char *file = loc == BUILTINS_LOCATION ? "<built-in>" : expand_location(loc).file;
  std::string where = file ? file : "";
  if (where == "<built-in>" && !past_built_ins) {
    predefined.insert(name);
  } else if (where == "<command-line>") {
    past_built_ins = true;
    // A second -D/-U of one name, or a -D of a predefined macro, warns: the warning depends on it.
    if (predefined.count(name) || command_line.count(name))
      used.insert(name);
    command_line.insert(name);
  } else if (where.empty() || where[0] == '<') {
    unknown_origin = true;
  } else {
    past_built_ins = true;
    if (command_line.count(name))
      used.insert(name);
  }
}

void on_define(cpp_reader *, location_t loc, cpp_hashnode *node) { changed(loc, node); }
void on_undef(cpp_reader *, location_t loc, cpp_hashnode *node) { changed(loc, node); }
void on_use(cpp_reader *, location_t, cpp_hashnode *node) {
  std::string name = name_of(node);
  if (command_line.count(name))
    used.insert(name);
}

int look(cpp_reader *, cpp_hashnode *node, void *) {
  if (NODE_LEN(node) >= watch.size() && !memcmp(NODE_NAME(node), watch.data(), watch.size()))
    seen.insert(name_of(node));
  return 1;
}

void scan(void *, void *) {
  // Before a collection purges identifiers nothing refers to any more, and at the end.
  if (!watch.empty() && parse_in)
    cpp_forall_identifiers(parse_in, look, nullptr);
}

void finish(void *, void *) {
  scan(nullptr, nullptr);
  // Appended: if two runs of cc1 share the file (the driver's -save-temps runs the preprocessor
  // and the compiler apart), two records in one file are no record.
  FILE *f = fopen(out_path, "a");
  if (!f)
    return;  // no record: the rebuilder then matches the exact command line only
  cpp_callbacks *cb = cpp_get_callbacks(parse_in);
  bool complete = cb->define == on_define && cb->undef == on_undef && cb->used_define == on_use &&
                  cb->used_undef == on_use && !unknown_origin &&
                  !flag_dump_macros &&                        // -dM/-dD/-dN/-dU write macros out
                  !cpp_get_options(parse_in)->preprocessed;  // input already preprocessed: no -D seen
  fprintf(f, "bgraph-macro-use 1\n");
  if (!complete) {
    fprintf(f, "incomplete\n");
  } else {
    fprintf(f, "watch %s\n", watch.c_str());
    for (const std::string &name : used)
      fprintf(f, "used %s\n", name.c_str());
    for (const std::string &name : seen)
      fprintf(f, "seen %s\n", name.c_str());
  }
  fclose(f);
}

}  // namespace

int plugin_init(struct plugin_name_args *info, struct plugin_gcc_version *version) {
  if (!plugin_default_version_check(version, &gcc_version)) {
    fprintf(stderr, "gcc_macro_use: built for GCC %s, loaded into another\n", gcc_version.basever);
    return 1;
  }
  for (int i = 0; i < info->argc; i++) {
    if (!strcmp(info->argv[i].key, "out") && info->argv[i].value)
      out_path = info->argv[i].value;
    else if (!strcmp(info->argv[i].key, "watch") && info->argv[i].value)
      watch = info->argv[i].value;
  }
  if (!out_path || !parse_in) {
    fprintf(stderr, "gcc_macro_use: needs -fplugin-arg-%s-out=FILE and a C or C++ front end\n", info->base_name);
    return 1;
  }
  // The front end sets its own callbacks after plugins load, but these four only for -dD, -dN,
  // -dU or -g3: finish() checks they are still ours.
  cpp_callbacks *cb = cpp_get_callbacks(parse_in);
  cb->define = on_define;
  cb->undef = on_undef;
  cb->used_define = on_use;
  cb->used_undef = on_use;
  register_callback(info->base_name, PLUGIN_GGC_START, scan, nullptr);
  register_callback(info->base_name, PLUGIN_FINISH, finish, nullptr);
  return 0;
}

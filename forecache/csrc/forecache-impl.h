#pragma once

// forecache: helpers its C++ sources share; not part of the API.

#include <cstddef>

// Writes a printf-style message into err (err_size bytes; nothing when err is NULL).
void forecache_set_err(char * err, size_t err_size, const char * fmt, ...)
#ifdef __GNUC__
    __attribute__((format(printf, 3, 4)))
#endif
    ;

// The layer of a routed-expert tensor named "blk.<il>.<name>_exps.weight" (llama.cpp's names), or -1
// for any other tensor.
int forecache_expert_layer(const char * name);

// Whether the loader leaves routed-expert tensors in the file (forecache_set_disk_experts).
bool forecache_disk_experts();

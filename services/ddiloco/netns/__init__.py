"""Network-namespace topology: a hub namespace (coordinator + outer optimizer) joined to one
namespace per datacenter (one learner each) by veth links shaped with tc, and the kernel's
byte counters of those links."""

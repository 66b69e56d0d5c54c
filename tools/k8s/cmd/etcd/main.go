// etcd's server, at the version k8s.io/kubernetes pins (go.etcd.io/etcd/server/v3): the
// etcd module's own main package lives in a module that cannot be required beside it.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}

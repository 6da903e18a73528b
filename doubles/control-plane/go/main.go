// The official Kubernetes control plane in one program for the tests:
//
//	control-plane etcd [etcd flags]
//	control-plane kube-apiserver [flags]
//	control-plane kube-scheduler [flags]
//	control-plane kube-controller-manager [flags]
//
// Each is the upstream command itself (etcd's main, the components' cobra
// commands), so its flags, defaults and behaviour are the releases'. One
// program instead of four shares the code they have in common, which halves
// what is built and cached.
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var command *cobra.Command
	switch os.Args[1] {
	case "etcd":
		etcdmain.Main(os.Args[1:])
		return
	case "kube-apiserver":
		command = apiserver.NewAPIServerCommand()
	case "kube-scheduler":
		command = scheduler.NewSchedulerCommand()
	case "kube-controller-manager":
		command = controllermanager.NewControllerManagerCommand()
	default:
		usage()
	}
	command.SetArgs(os.Args[2:])
	os.Exit(cli.Run(command))
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: control-plane etcd|kube-apiserver|kube-scheduler|kube-controller-manager [flags]")
	os.Exit(2)
}

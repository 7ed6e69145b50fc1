// Command kube is a multi-call binary for a throwaway local cluster: the first argument names the
// component and the rest are its own flags.
//
//	kube etcd -data-dir DIR -client-port N -peer-port N
//	kube kube-apiserver --etcd-servers=... (kube-apiserver's flags)
//	kube kube-controller-manager ...
//	kube kube-scheduler ...
//	kube kubelet ...          (a real node: runs pods through a CRI runtime such as containerd)
//	kube kube-proxy ...       (Service virtual IPs on that node)
//	kube coredns -conf FILE   (cluster DNS: CoreDNS with only the plugins a local cluster needs)
//
// One binary links the large shared Kubernetes packages once (a cold build on 2 cores takes minutes).
// The Kubernetes components are the upstream commands from k8s.io/kubernetes/cmd/*/app; etcd is the
// embedded server of go.etcd.io/etcd/server/v3/embed with only what a single-member test store needs;
// CoreDNS is github.com/coredns/coredns's server with the plugin list below.
package main

import (
	"context"
	"flag"
	"fmt"
	"net/url"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/embed"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register" // --logging-format=json, as the upstream binaries offer
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"

	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	// the CoreDNS plugins the local cluster's Corefile uses (each registers itself)
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

// coreDNSDirectives is the order in which CoreDNS runs the plugins above (a subset of its own list).
var coreDNSDirectives = []string{"errors", "log", "health", "ready", "kubernetes", "cache", "forward"}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr,
			"usage: kube {etcd|kube-apiserver|kube-controller-manager|kube-scheduler|kubelet|kube-proxy|coredns} [flags]")
		os.Exit(2)
	}
	name, args := os.Args[1], os.Args[2:]
	var cmd *cobra.Command
	switch name {
	case "etcd":
		os.Exit(runEtcd(args))
	case "kube-apiserver":
		cmd = apiserver.NewAPIServerCommand()
	case "kube-controller-manager":
		cmd = controllermanager.NewControllerManagerCommand()
	case "kube-scheduler":
		cmd = scheduler.NewSchedulerCommand()
	case "kubelet":
		cmd = kubelet.NewKubeletCommand(context.Background())
	case "kube-proxy":
		cmd = proxy.NewProxyCommand()
	case "coredns":
		dnsserver.Directives = coreDNSDirectives
		os.Args = append([]string{"coredns"}, args...)
		coremain.Run()
		return
	default:
		fmt.Fprintf(os.Stderr, "kube: unknown component %q\n", name)
		os.Exit(2)
	}
	cmd.SetArgs(args)
	os.Exit(cli.Run(cmd))
}

// runEtcd serves a single-member etcd on 127.0.0.1 until SIGINT or SIGTERM.
func runEtcd(args []string) int {
	fs := flag.NewFlagSet("etcd", flag.ContinueOnError)
	dataDir := fs.String("data-dir", "", "directory of the store (required)")
	clientPort := fs.Int("client-port", 2379, "client port on 127.0.0.1")
	peerPort := fs.Int("peer-port", 2380, "peer port on 127.0.0.1")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *dataDir == "" {
		fmt.Fprintln(os.Stderr, "etcd: -data-dir is required")
		return 2
	}
	client := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", *clientPort)}
	peer := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", *peerPort)}
	cfg := embed.NewConfig()
	cfg.Name = "test"
	cfg.Dir = *dataDir
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{client}, []url.URL{client}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{peer}, []url.URL{peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.LogLevel = "warn"
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		fmt.Fprintf(os.Stderr, "etcd: %v\n", err)
		return 1
	}
	defer e.Close()
	select {
	case <-e.Server.ReadyNotify():
		fmt.Fprintf(os.Stderr, "etcd: ready on %s\n", client.String())
	case <-time.After(60 * time.Second):
		fmt.Fprintln(os.Stderr, "etcd: not ready after 60s")
		return 1
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	select {
	case err := <-e.Err():
		fmt.Fprintf(os.Stderr, "etcd: %v\n", err)
		return 1
	case <-stop:
		return 0
	}
}

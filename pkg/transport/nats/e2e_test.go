package nats_test

import (
	"testing"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/topology"
	nats "github.com/fifobox/fifobox/pkg/transport/nats"
	"github.com/fifobox/fifobox/pkg/transport/transporttest"
)

// TestEndToEnd runs the pipeline suite (outbox -> dispatcher -> stream ->
// one durable consumer per subscriber -> a Runner per consumer applying
// through the inbox) on this machine's NATS server, each preset on streams
// of its own.
func TestEndToEnd(t *testing.T) {
	t.Parallel()
	transporttest.RunPipeline(t, harness)
}

// presets are the shipped topologies by transporttest.Preset name.
var presets = map[string]func() (nats.Topology, error){
	transporttest.Holdco.Name:    func() (nats.Topology, error) { return nats.Holdco(), nil },
	transporttest.Ticketing.Name: func() (nats.Topology, error) { return nats.Ticketing(), nil },
	transporttest.Corewrite.Name: func() (nats.Topology, error) { return nats.Corewrite(), nil },
	transporttest.Default.Name:   func() (nats.Topology, error) { return nats.FromTopology(topology.Default()) },
}

func preset(t *testing.T, name string) (transporttest.Deployment, transporttest.Routing) {
	topo, err := presets[name]()
	if err != nil {
		t.Fatal(err)
	}
	d := newDeployment(t, topo)
	if err := d.cfg.Topology.Prepare(); err != nil {
		t.Fatal(err)
	}
	topo = d.cfg.Topology
	r := transporttest.Routing{Routes: routes(topo)}
	for _, c := range topo.Consumers {
		r.Consumers = append(r.Consumers, c.Name)
	}
	return d, r
}

// routes says which consumers an event must reach: the consumers whose
// filters select its subject (topo prepared).
func routes(topo nats.Topology) func(envelope.Envelope) []string {
	return func(e envelope.Envelope) []string {
		var out []string
		m := message(e)
		subject := topo.EventSubject(&m)
		for _, c := range topo.Consumers {
			if topo.Selects(c, subject) {
				out = append(out, c.Name)
			}
		}
		return out
	}
}

package amqp_test

import (
	"strings"
	"testing"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/transporttest"
)

// TestEndToEnd runs the pipeline suite (outbox -> dispatcher -> exchange ->
// one queue per consumer -> a Runner per consumer applying through the
// inbox) on this machine's RabbitMQ, each preset in a vhost of its own.
func TestEndToEnd(t *testing.T) {
	t.Parallel()
	transporttest.RunPipeline(t, harness)
}

// presets are the shipped topologies by transporttest.Preset name; the
// default topology converts to a headers exchange.
var presets = map[string]func() amqp.Topology{
	transporttest.Holdco.Name:    amqp.Holdco,
	transporttest.Ticketing.Name: amqp.Ticketing,
	transporttest.Corewrite.Name: amqp.Corewrite,
	transporttest.Default.Name:   func() amqp.Topology { return amqp.FromTopology(topology.Default()) },
}

func preset(t *testing.T, name string) (transporttest.Deployment, transporttest.Routing) {
	topo := presets[name]()
	cfg, v := setup(t, topo)
	r := transporttest.Routing{Routes: routes(topo)}
	for _, c := range topo.Consumers {
		r.Consumers = append(r.Consumers, c.Name)
	}
	return &deployment{t: t, cfg: cfg, vhost: v}, r
}

// routes says which consumers an event must reach, worked out here rather
// than by the package's routing code: topic binding semantics (words split
// on '.', '*' one word, '#' zero or more), headers: every header of a
// binding equal, fanout: every consumer.
func routes(topo amqp.Topology) func(envelope.Envelope) []string {
	return func(e envelope.Envelope) []string {
		var out []string
		m := message(e)
		for _, c := range topo.Consumers {
			if topo.Exchange.Kind == amqp.KindFanout {
				out = append(out, c.Name)
				continue
			}
			if topo.Exchange.Kind == amqp.KindHeaders {
				for _, b := range c.Bindings {
					ok := true
					for k, v := range b.Headers {
						ok = ok && m.Attributes[k] == v
					}
					if ok {
						out = append(out, c.Name)
						break
					}
				}
				continue
			}
			key := renderKey(topo.RoutingKey, m)
			for _, b := range c.Bindings {
				if topicMatch(strings.Split(b.Key, "."), strings.Split(key, ".")) {
					out = append(out, c.Name)
					break
				}
			}
		}
		return out
	}
}

func renderKey(tpl string, m outbox.Message) string {
	r := strings.NewReplacer("{aggregate_type}", m.AggregateType, "{event_type}", m.EventType, "{aggregate_id}", m.GroupID)
	return r.Replace(tpl)
}

func topicMatch(pat, words []string) bool {
	if len(pat) == 0 {
		return len(words) == 0
	}
	switch pat[0] {
	case "#":
		for i := 0; i <= len(words); i++ {
			if topicMatch(pat[1:], words[i:]) {
				return true
			}
		}
		return false
	case "*":
		return len(words) > 0 && topicMatch(pat[1:], words[1:])
	}
	return len(words) > 0 && words[0] == pat[0] && topicMatch(pat[1:], words[1:])
}

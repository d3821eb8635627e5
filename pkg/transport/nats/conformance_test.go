package nats_test

import (
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
	nats "github.com/fifobox/fifobox/pkg/transport/nats"
	"github.com/fifobox/fifobox/pkg/transport/transporttest"
)

func TestMain(m *testing.M) { transporttest.Main(m, harness) }

// TestConformance runs the suite every transport passes against this
// machine's NATS server, each test on streams of its own.
func TestConformance(t *testing.T) { transporttest.Run(t, harness) }

var harness = transporttest.Harness{
	Name: "nats",
	New: func(t *testing.T, o transporttest.Options) transporttest.Deployment {
		needServer(t)
		ackWait := o.AckWait
		if ackWait == 0 {
			ackWait = 2 * time.Second // redeliveries of a killed consumer's messages come soon
		}
		topo := nats.Topology{Stream: "CONF", SubjectPrefix: "conf"}
		for _, name := range o.Consumers {
			topo.Consumers = append(topo.Consumers, nats.Consumer{Name: name, Filters: []string{">"}, Retry: o.Retry,
				AckWait: transport.Duration(ackWait), Workers: o.Lanes})
		}
		return newDeployment(t, topo)
	},
	Preset: preset,
	Rebuild: func(spec string) (transporttest.Deployment, error) {
		var cfg nats.Config
		if err := json.Unmarshal([]byte(spec), &struct {
			URL      *string        `json:"url"`
			Topology *nats.Topology `json:"topology"`
		}{&cfg.URL, &cfg.Topology}); err != nil {
			return nil, err
		}
		cfg.URL = serverURL()
		cfg.ReconnectMaxDelay = 500 * time.Millisecond
		return &deployment{cfg: cfg}, nil
	},
	Features: transporttest.Features{RedeliveryTimeout: true},
}

// newDeployment provisions topo on streams of the test's own; every client
// of the deployment connects through a proxy the suite can cut.
func newDeployment(t *testing.T, topo nats.Topology) *deployment {
	cfg := setup(t, topo)
	px := transporttest.NewProxy(t, strings.TrimPrefix(serverURL(), "nats://"))
	cfg.URL = "nats://" + px.Addr()
	return &deployment{t: t, cfg: cfg, px: px}
}

// deployment is one test's streams and consumers.
type deployment struct {
	t   *testing.T // nil in a child process
	cfg nats.Config
	px  *transporttest.Proxy

	once sync.Once
	pub  *nats.Publisher
	ops  *nats.Operations
}

func (d *deployment) init() {
	d.once.Do(func() {
		var err error
		if d.pub, err = nats.NewPublisher(d.cfg); err != nil {
			panic(err)
		}
		if d.ops, err = nats.NewOperations(d.cfg); err != nil {
			panic(err)
		}
		if d.t != nil {
			d.t.Cleanup(func() { _ = d.pub.Close(); _ = d.ops.Close() })
		}
	})
}

func (d *deployment) Publisher() outbox.Publisher      { d.init(); return d.pub }
func (d *deployment) Operations() transport.Operations { d.init(); return d.ops }
func (d *deployment) CutConnections(*testing.T) int    { return d.px.Cut() }
func (d *deployment) Runner(c string, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) (transport.Runner, error) {
	return nats.NewRunner(d.cfg, db, apply, cc)
}

func (d *deployment) Spec() string {
	b, err := json.Marshal(map[string]any{"url": d.cfg.URL, "topology": d.cfg.Topology})
	if err != nil {
		panic(err)
	}
	return string(b)
}

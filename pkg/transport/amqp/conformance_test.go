package amqp_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/amqp/amqptest"
	"github.com/fifobox/fifobox/pkg/transport/transporttest"
)

func TestMain(m *testing.M) { transporttest.Main(m, harness) }

// TestConformance runs the suite every transport passes against this
// machine's RabbitMQ, each test in a vhost of its own.
func TestConformance(t *testing.T) { transporttest.Run(t, harness) }

var harness = transporttest.Harness{
	Name: "rabbitmq",
	New: func(t *testing.T, o transporttest.Options) transporttest.Deployment {
		topo := amqp.Topology{Exchange: amqp.Exchange{Name: "events", Kind: amqp.KindTopic}, RoutingKey: "{aggregate_type}.{event_type}"}
		for _, name := range o.Consumers {
			topo.Consumers = append(topo.Consumers, amqp.Consumer{Name: name, Bindings: []amqp.Binding{{Key: "#"}}, Retry: o.Retry, Workers: o.Lanes})
		}
		cfg, v := setup(t, topo)
		return &deployment{t: t, cfg: cfg, vhost: v}
	},
	Preset: preset,
	Rebuild: func(spec string) (transporttest.Deployment, error) {
		var cfg amqp.Config
		if err := json.Unmarshal([]byte(spec), &struct {
			URL      *string        `json:"url"`
			Topology *amqp.Topology `json:"topology"`
		}{&cfg.URL, &cfg.Topology}); err != nil {
			return nil, err
		}
		cfg.ReconnectMaxDelay = 500 * time.Millisecond
		return &deployment{cfg: cfg}, nil
	},
	Features: transporttest.Features{Lambda: lambdaSource},
}

// deployment is one vhost with the suite's topology.
type deployment struct {
	t     *testing.T // nil in a child process
	cfg   amqp.Config
	vhost *amqptest.Vhost

	once sync.Once
	pub  *amqp.Publisher
	ops  *amqp.Operations
}

func (d *deployment) init() {
	d.once.Do(func() {
		var err error
		if d.pub, err = amqp.NewPublisher(d.cfg); err != nil {
			panic(err)
		}
		if d.ops, err = amqp.NewOperations(d.cfg); err != nil {
			panic(err)
		}
		if d.t != nil {
			d.t.Cleanup(func() { _ = d.pub.Close(); _ = d.ops.Close() })
		}
	})
}

func (d *deployment) Publisher() outbox.Publisher      { d.init(); return d.pub }
func (d *deployment) Operations() transport.Operations { d.init(); return d.ops }
func (d *deployment) CutConnections(t *testing.T) int  { return d.vhost.CloseConnections(t) }
func (d *deployment) Runner(c string, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) (transport.Runner, error) {
	return amqp.NewRunner(d.cfg, db, apply, cc)
}

func (d *deployment) Spec() string {
	b, err := json.Marshal(map[string]any{"url": d.cfg.URL, "topology": d.cfg.Topology})
	if err != nil {
		panic(err)
	}
	return string(b)
}

// lambdaSource runs amqp.LambdaHandler the way Lambda's Amazon MQ event
// source does: it takes the queue's waiting messages unacknowledged, hands
// them over in one event, and acknowledges them all when the handler
// returns nil, or returns them all to the queue when it fails.
func lambdaSource(t *testing.T, dep transporttest.Deployment, consumer string, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) transporttest.LambdaSource {
	d := dep.(*deployment)
	h, err := amqp.NewLambdaHandler(d.cfg, db, apply, cc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	c, _ := d.cfg.Topology.Consumer(consumer)
	return &eventSource{t: t, h: h, url: d.cfg.URL, queue: c.QueueName(), vhost: d.vhost.Name}
}

type eventSource struct {
	t            *testing.T
	h            *amqp.LambdaHandler
	url          string
	queue, vhost string
}

func (s *eventSource) Invoke(ctx context.Context, n int) (int, error) {
	conn, err := amqp091.Dial(s.url)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return 0, err
	}
	defer ch.Close()
	if err := ch.Qos(n, 0, false); err != nil {
		return 0, err
	}
	ds, err := ch.Consume(s.queue, "lambda-esm", false, false, false, false, nil)
	if err != nil {
		return 0, fmt.Errorf("consume %s: %w", s.queue, err)
	}
	var batch []amqp091.Delivery
	wait := 2 * time.Second // the batching window, longer for the first message
	for len(batch) < n {
		select {
		case m := <-ds:
			batch = append(batch, m)
			wait = 200 * time.Millisecond
			continue
		case <-time.After(wait):
		}
		break
	}
	if len(batch) == 0 {
		return 0, nil
	}
	last := batch[len(batch)-1].DeliveryTag
	if err := s.h.Handle(ctx, lambdaEvent(s.t, s.queue, s.vhost, batch)); err != nil {
		_ = ch.Nack(last, true, true)
		return len(batch), err
	}
	return len(batch), ch.Ack(last, true)
}

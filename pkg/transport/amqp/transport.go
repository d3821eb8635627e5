package amqp

import (
	"errors"
	"fmt"
	"net/url"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Transport is RabbitMQ as a transport.Transport: one publisher, the
// provisioner, operations, and runners per consumer, sharing a config.
type Transport struct {
	cfg  Config
	pub  *Publisher
	prov transport.Provisioner
	ops  *Operations
}

var (
	_ transport.Transport      = (*Transport)(nil)
	_ transport.LambdaConsumer = (*Transport)(nil)
)

// New returns a Transport for cfg; nothing connects until used.
func New(cfg Config) (*Transport, error) {
	if err := cfg.prepare(); err != nil {
		return nil, fmt.Errorf("new amqp transport: %w", err)
	}
	t := &Transport{cfg: cfg}
	var err error
	if t.pub, err = NewPublisher(cfg); err != nil {
		return nil, err
	}
	if t.prov, err = newProvisioner(cfg); err != nil {
		return nil, err
	}
	if t.ops, err = NewOperations(cfg); err != nil {
		return nil, err
	}
	return t, nil
}

// FromEnv is New(ConfigFromEnv()). Consumers it returns also read
// FIFOBOX_LOG_AGGREGATE_IDS.
func FromEnv() (*Transport, error) {
	cfg, err := ConfigFromEnv()
	if err != nil {
		return nil, err
	}
	return New(cfg)
}

// Kind is transport.RabbitMQ.
func (t *Transport) Kind() transport.Kind { return transport.RabbitMQ }

// String names the broker and exchange, without credentials.
func (t *Transport) String() string {
	host := "(broker)"
	if u, err := url.Parse(t.cfg.URL); err == nil && u.Host != "" {
		host = u.Scheme + "://" + u.Host
	}
	return fmt.Sprintf("RabbitMQ %s, exchange %s", host, t.cfg.Topology.Exchange.Name)
}

// Config is the effective configuration.
func (t *Transport) Config() Config { return t.cfg }

// Publisher returns the shared publisher.
func (t *Transport) Publisher() (transport.Publisher, error) { return t.pub, nil }

// Provisioner returns the provisioner.
func (t *Transport) Provisioner() (transport.Provisioner, error) { return t.prov, nil }

// Operations returns the operations.
func (t *Transport) Operations() (transport.Operations, error) { return t.ops, nil }

// Consumer returns a Runner for the named consumer.
func (t *Transport) Consumer(name string, db inbox.DB, apply inbox.Apply) (transport.Runner, error) {
	if err := t.inTopology(name); err != nil {
		return nil, err
	}
	table, err := inbox.TableFromEnv()
	if err != nil {
		return nil, err
	}
	return NewRunner(t.cfg, db, apply, inbox.ConsumerConfig{Consumer: name, Inbox: table, LogAggregateIDs: Env.Get(EnvLogAggregateIDs) == "true"})
}

// inTopology reports a consumer the topology lacks, naming the variable
// that chose the topology.
func (t *Transport) inTopology(name string) error {
	if _, ok := t.cfg.Topology.Consumer(name); !ok {
		return fmt.Errorf("consumer %q is not in the topology (%s)", name, EnvTopology)
	}
	return nil
}

// Close closes the publisher's and operations' connections.
func (t *Transport) Close() error {
	return errors.Join(t.pub.Close(), t.ops.Close())
}

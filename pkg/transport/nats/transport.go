package natsbus

import (
	"errors"
	"fmt"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Transport is NATS JetStream as a transport.Transport: one publisher, the
// provisioner, operations, and runners per consumer, sharing a config.
type Transport struct {
	cfg  Config
	pub  *Publisher
	prov transport.Provisioner
	ops  *Operations
}

var _ transport.Transport = (*Transport)(nil)

// New returns a Transport for cfg; nothing connects until used.
func New(cfg Config) (*Transport, error) {
	if err := cfg.prepare(); err != nil {
		return nil, fmt.Errorf("new nats transport: %w", err)
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

// Kind is transport.NATS.
func (t *Transport) Kind() transport.Kind { return transport.NATS }

// Config is the effective configuration.
func (t *Transport) Config() Config { return t.cfg }

// Publisher returns the shared publisher.
func (t *Transport) Publisher() transport.Publisher { return t.pub }

// Provisioner returns the provisioner.
func (t *Transport) Provisioner() transport.Provisioner { return t.prov }

// Operations returns the operations.
func (t *Transport) Operations() transport.Operations { return t.ops }

// Consumer returns a Runner for the named consumer.
func (t *Transport) Consumer(name string, db inbox.DB, apply inbox.Apply) (transport.Runner, error) {
	return NewRunner(t.cfg, db, apply, ConsumerConfig{Consumer: name, LogAggregateIDs: Env.Get(EnvLogAggregateIDs) == "true"})
}

// Close closes the publisher's and operations' connections.
func (t *Transport) Close() error {
	return errors.Join(t.pub.Close(), t.ops.Close())
}

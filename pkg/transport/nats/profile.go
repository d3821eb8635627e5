package nats

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/wire"
)

// This file is NATS's side of wire profiles (pkg/wire): a publisher with
// Config.Wire set publishes each event on the subject, with the body and
// headers, the profile renders, into the profile's stream, and
// ProfileProvisioner creates that stream.

// wireOutgoing renders m through the profile.
func (p *Publisher) wireOutgoing(m *outbox.Message) (outgoing, error) {
	w, err := p.cfg.Wire.Render(m)
	if err != nil {
		return outgoing{}, envelope.Permanent(err)
	}
	h := make(nats.Header, len(w.Headers)+1)
	for _, x := range w.Headers {
		// Set directly, not through Header.Set: the profile's spelling is
		// what its consumers read.
		h[x.Name] = []string{headerValue(fmt.Sprint(x.Value))}
	}
	h[HeaderMsgID] = []string{w.MessageID}
	return outgoing{msg: &nats.Msg{Subject: w.Destination, Data: w.Body, Header: h}, stream: p.cfg.Wire.Profile().NATS.Stream.Name}, nil
}

// ProfileProvisioner creates a profile's stream. A stream that exists with
// the profile's settings is left alone; one with other settings is
// ErrTopologyConflict naming every difference, and is not changed.
type ProfileProvisioner struct {
	cfg Config
}

var _ transport.Provisioner = (*ProfileProvisioner)(nil)

// NewProfileProvisioner returns a provisioner for cfg.Wire's profile.
func NewProfileProvisioner(cfg Config) (*ProfileProvisioner, error) {
	if err := cfg.prepare(); err != nil {
		return nil, fmt.Errorf("new nats profile provisioner: %w", err)
	}
	if cfg.Wire == nil {
		return nil, errors.New("new nats profile provisioner: Config.Wire is not set")
	}
	return &ProfileProvisioner{cfg: cfg}, nil
}

// StreamConfig is the profile's stream. Discard-new: a full stream refuses
// a publish (retryable) rather than dropping its oldest events.
func StreamConfig(s wire.NATSStream) jetstream.StreamConfig {
	ret := jetstream.LimitsPolicy
	switch s.Retention {
	case "interest":
		ret = jetstream.InterestPolicy
	case "workqueue":
		ret = jetstream.WorkQueuePolicy
	}
	return jetstream.StreamConfig{
		Name:       s.Name,
		Subjects:   s.Subjects,
		Retention:  ret,
		Discard:    jetstream.DiscardNew,
		MaxAge:     time.Duration(s.MaxAge),
		MaxBytes:   -1,
		MaxMsgSize: -1,
		MaxMsgs:    -1,
		Storage:    storageType(s.Storage),
		Replicas:   s.Replicas,
		Duplicates: time.Duration(s.DuplicateWindow),
	}
}

// Provision implements transport.Provisioner.
func (p *ProfileProvisioner) Provision(ctx context.Context) error {
	prof := p.cfg.Wire.Profile()
	nc, err := p.cfg.dial("provisioner")
	if err != nil {
		return fmt.Errorf("provision profile %s: %w", prof.Name, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("provision profile %s: %w", prof.Name, err)
	}
	_, diff, err := ensureStream(ctx, js, StreamConfig(prof.NATS.Stream))
	if err != nil {
		return fmt.Errorf("provision profile %s: nats.stream %s: %w", prof.Name, prof.NATS.Stream.Name, err)
	}
	if len(diff) > 0 {
		return fmt.Errorf("provision profile %s: nats.stream: %w: %s", prof.Name, ErrTopologyConflict, strings.Join(diff, "; "))
	}
	p.cfg.Logger.Info("nats: profile provisioned", "profile", prof.Name, "stream", prof.NATS.Stream.Name)
	return nil
}

// wireFromEnv reads FIFOBOX_PROFILE: nil when unset.
func wireFromEnv() (*wire.Mapper, error) { return wire.MapperFromEnv(wire.TransportNATS) }

// newProvisioner is the transport's provisioner: the profile's when
// Config.Wire is set, else the topology's.
func newProvisioner(cfg Config) (transport.Provisioner, error) {
	if cfg.Wire == nil {
		return NewProvisioner(cfg)
	}
	return NewProfileProvisioner(cfg)
}

// wireCaptures reports whether the profile's stream captures subject.
func (p *Publisher) wireCaptures(subject string) bool {
	for _, pat := range p.cfg.Wire.Profile().NATS.Stream.Subjects {
		if SubjectMatches(pat, subject) {
			return true
		}
	}
	return false
}

// validateWire refuses what a wire profile cannot do: the alternate
// unrouted policy needs the topology's dead-letter stream subjects.
func (c *Config) validateWire() error {
	if c.Wire == nil {
		return nil
	}
	if c.Wire.Profile().NATS == nil {
		return fmt.Errorf("Wire: profile %s has no nats section", c.Wire.Profile().Name)
	}
	if c.Topology.Unrouted.Policy == transport.UnroutedAlternate {
		return fmt.Errorf("Wire (%s): profile %s: the alternate unrouted policy works with a topology's streams only; use deliver (the default)", wire.EnvProfile, c.Wire.Profile().Name)
	}
	return nil
}

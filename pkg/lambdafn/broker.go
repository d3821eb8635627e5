package lambdafn

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/secretsmanager"

	"github.com/fifobox/fifobox/pkg/awsclient"
	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	natsbus "github.com/fifobox/fifobox/pkg/transport/nats"
	"github.com/fifobox/fifobox/pkg/wire"
)

// The broker credentials' variables: on AWS the functions read the broker's
// user from Secrets Manager at init, so no password sits in a function's
// configuration.
const (
	EnvAMQPSecretARN = "FIFOBOX_AMQP_SECRET_ARN"
	EnvNATSSecretARN = "FIFOBOX_NATS_SECRET_ARN"
)

// BrokerEnv is every variable BrokerFromEnv reads: the transport's choice,
// that transport's settings, and the secret holding its credentials.
var BrokerEnv = envspec.Join(transport.Env, amqp.Env, amqp.ProfileEnv, natsbus.Env, wire.Env, envspec.Set{
	{Name: EnvAMQPSecretARN, Doc: `Secrets Manager secret {"username","password"} for FIFOBOX_AMQP_URL (Amazon MQ: the event source mapping's BASIC_AUTH secret); unset: credentials in the URL`},
	{Name: EnvNATSSecretARN, Doc: `Secrets Manager secret {"username","password"}, {"token"} or {"creds"} (a .creds file's contents) for FIFOBOX_NATS_URL; unset: none or FIFOBOX_NATS_CREDS/USER/PASSWORD`},
})

// Broker is the transport a function publishes through or consumes from, as
// its environment chose it (FIFOBOX_TRANSPORT). For SNS (the default) the
// functions keep their SNS/SQS wiring and Broker carries nothing else.
type Broker struct {
	Kind transport.Kind
	// AMQP is RabbitMQ's configuration (Kind RabbitMQ).
	AMQP amqp.Config
	// NATS is NATS JetStream's configuration (Kind NATS).
	NATS natsbus.Config
	// SecretARN names the Secrets Manager secret with the broker's
	// credentials (FIFOBOX_AMQP_SECRET_ARN or FIFOBOX_NATS_SECRET_ARN).
	SecretARN string
}

// BrokerFromEnv reads FIFOBOX_TRANSPORT and, for rabbitmq or nats, that
// transport's settings and secret ARN. It does not connect or fetch the
// secret (Credentials does). Errors name the variable.
func BrokerFromEnv() (Broker, error) {
	k, err := transport.KindFromEnv()
	if err != nil {
		return Broker{}, err
	}
	b := Broker{Kind: k}
	switch k {
	case transport.RabbitMQ:
		if b.AMQP, err = amqp.ConfigFromEnv(); err != nil {
			return b, err
		}
		b.SecretARN = BrokerEnv.Get(EnvAMQPSecretARN)
		if b.SecretARN != "" {
			if u, _ := url.Parse(b.AMQP.URL); u != nil && u.User != nil {
				return b, fmt.Errorf("%s and credentials in %s: set one or the other", EnvAMQPSecretARN, amqp.EnvURL)
			}
		}
	case transport.NATS:
		if b.NATS, err = natsbus.ConfigFromEnv(); err != nil {
			return b, err
		}
		b.SecretARN = BrokerEnv.Get(EnvNATSSecretARN)
		if b.SecretARN != "" && (b.NATS.CredsFile != "" || b.NATS.User != "") {
			return b, fmt.Errorf("%s and %s or %s: set one kind of credentials", EnvNATSSecretARN, natsbus.EnvCredsFile, natsbus.EnvUser)
		}
	default:
		if v := BrokerEnv.Get(EnvAMQPSecretARN) + BrokerEnv.Get(EnvNATSSecretARN); v != "" {
			return b, fmt.Errorf("%s or %s is set, but %s=%s: set %s to the broker's transport", EnvAMQPSecretARN, EnvNATSSecretARN, transport.EnvTransport, k, transport.EnvTransport)
		}
	}
	return b, nil
}

// SecretFunc returns a secret's string value.
type SecretFunc func(ctx context.Context, arn string) (string, error)

// SecretsManager reads secrets from AWS Secrets Manager with awsCfg.
func SecretsManager(awsCfg aws.Config) SecretFunc {
	c := secretsmanager.NewFromConfig(awsCfg, func(o *secretsmanager.Options) { o.HTTPClient = awsclient.HTTPClient() })
	return func(ctx context.Context, arn string) (string, error) {
		out, err := c.GetSecretValue(ctx, &secretsmanager.GetSecretValueInput{SecretId: aws.String(arn)})
		if err != nil {
			return "", err
		}
		if out.SecretString == nil {
			return "", errors.New("secret has no string value")
		}
		return *out.SecretString, nil
	}
}

// brokerSecret is the JSON a broker secret holds: Amazon MQ's and RDS's
// {"username","password"}, or for NATS a token or a .creds file's contents.
type brokerSecret struct {
	Username string `json:"username"`
	Password string `json:"password"`
	Token    string `json:"token"`
	Creds    string `json:"creds"`
}

// Credentials reads SecretARN (when set) with fetch and puts the
// credentials into the transport's configuration. Errors name the variable
// and never carry the secret's value.
func (b *Broker) Credentials(ctx context.Context, fetch SecretFunc) error {
	if b.SecretARN == "" {
		return nil
	}
	env := EnvAMQPSecretARN
	if b.Kind == transport.NATS {
		env = EnvNATSSecretARN
	}
	ctx, cancel := context.WithTimeout(ctx, InitTimeout)
	defer cancel()
	raw, err := fetch(ctx, b.SecretARN)
	if err != nil {
		return fmt.Errorf("%s: read secret: %w", env, err)
	}
	var s brokerSecret
	if err := json.Unmarshal([]byte(raw), &s); err != nil {
		return fmt.Errorf("%s: secret is not a JSON object", env)
	}
	switch b.Kind {
	case transport.RabbitMQ:
		if s.Username == "" || s.Password == "" {
			return fmt.Errorf("%s: secret needs username and password", env)
		}
		u, err := url.Parse(b.AMQP.URL)
		if err != nil {
			return fmt.Errorf("%s: %w", amqp.EnvURL, err)
		}
		u.User = url.UserPassword(s.Username, s.Password)
		b.AMQP.URL = u.String()
	case transport.NATS:
		switch {
		case s.Creds != "" && s.Username == "" && s.Token == "":
			// nats.go reads credentials from a file; /tmp is the only
			// writable place in a Lambda, and only this process reads it.
			f := filepath.Join(os.TempDir(), "fifobox-nats.creds")
			if err := os.WriteFile(f, []byte(s.Creds), 0o600); err != nil {
				return fmt.Errorf("%s: write credentials file: %w", env, err)
			}
			b.NATS.CredsFile = f
		case s.Token != "" && s.Username == "" && s.Creds == "":
			b.NATS.Token = s.Token
		case s.Username != "" && s.Password != "" && s.Token == "" && s.Creds == "":
			b.NATS.User, b.NATS.Password = s.Username, s.Password
		default:
			return fmt.Errorf("%s: secret needs exactly one of username+password, token or creds", env)
		}
	default:
		return fmt.Errorf("%s: transport %s takes no broker secret", env, b.Kind)
	}
	return nil
}

// Publisher returns the broker's publisher for the dispatcher, and its
// Close. For SNS it returns an error: the dispatcher builds its SNS
// publisher itself (pkg/outbox/snspub).
func (b Broker) Publisher(log *slog.Logger) (outbox.Publisher, func() error, error) {
	switch b.Kind {
	case transport.RabbitMQ:
		c := b.AMQP
		c.Logger = log
		p, err := amqp.NewPublisher(c)
		if err != nil {
			return nil, nil, err
		}
		return p, p.Close, nil
	case transport.NATS:
		c := b.NATS
		c.Logger = log
		p, err := natsbus.NewPublisher(c)
		if err != nil {
			return nil, nil, err
		}
		return p, p.Close, nil
	}
	return nil, nil, fmt.Errorf("broker publisher: transport %s has none here", b.Kind)
}

// Operations returns the broker side of the operator's commands (queue
// depths, dlq-redrive, replay), and its Close.
func (b Broker) Operations(log *slog.Logger) (transport.Operations, func() error, error) {
	switch b.Kind {
	case transport.RabbitMQ:
		c := b.AMQP
		c.Logger = log
		o, err := amqp.NewOperations(c)
		if err != nil {
			return nil, nil, err
		}
		return o, o.Close, nil
	case transport.NATS:
		c := b.NATS
		c.Logger = log
		o, err := natsbus.NewOperations(c)
		if err != nil {
			return nil, nil, err
		}
		return o, o.Close, nil
	}
	return nil, nil, fmt.Errorf("broker operations: transport %s has none here", b.Kind)
}

// Provisioner returns the broker's topology provisioner (idempotent
// declarations of exchanges, queues, streams and consumers), which the
// operations function runs with migrate, so a deploy leaves the broker
// ready before any consumer or the schedule starts.
func (b Broker) Provisioner(log *slog.Logger) (transport.Provisioner, error) {
	switch b.Kind {
	case transport.RabbitMQ:
		c := b.AMQP
		c.Logger = log
		return amqp.NewProvisioner(c)
	case transport.NATS:
		c := b.NATS
		c.Logger = log
		return natsbus.NewProvisioner(c)
	}
	return nil, fmt.Errorf("broker provisioner: transport %s has none here", b.Kind)
}

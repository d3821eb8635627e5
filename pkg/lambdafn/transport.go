package lambdafn

import (
	"context"
	"errors"
	"log/slog"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/secretsmanager"

	"github.com/fifobox/fifobox/pkg/awsclient"
	"github.com/fifobox/fifobox/pkg/transport"
	// The transports a function can be deployed with (FIFOBOX_TRANSPORT):
	// each registers itself with transport.Open.
	_ "github.com/fifobox/fifobox/pkg/transport/amqp"
	_ "github.com/fifobox/fifobox/pkg/transport/nats"
	_ "github.com/fifobox/fifobox/pkg/transport/sns"
)

// SecretsManager reads secrets from AWS Secrets Manager with awsCfg: what
// the functions pass transport.Open, so a broker's credentials
// (FIFOBOX_AMQP_SECRET_ARN, FIFOBOX_NATS_SECRET_ARN) never sit in a
// function's configuration.
func SecretsManager(awsCfg aws.Config) transport.SecretFunc {
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

// OpenTransport opens the transport FIFOBOX_TRANSPORT names
// (transport.Open), reading broker secrets from Secrets Manager, within
// InitTimeout. Called once per cold start, after Connect.
func OpenTransport(ctx context.Context, awsCfg aws.Config) (transport.Transport, error) {
	ctx, cancel := context.WithTimeout(ctx, InitTimeout)
	defer cancel()
	return transport.Open(ctx, transport.Options{Logger: slog.Default(), Secret: SecretsManager(awsCfg)})
}
